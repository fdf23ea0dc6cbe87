//! `elementwise.wgsl`: binary ops, scale, bias add, activations and their
//! backward forms.
//!
//! Backward forms of the linear ops are other forward kernels: for
//! `out = x + y`, dx = dy and dy_y = dy; for `x - y`, dy_y = scale(dy, -1);
//! for `x * y`, dx = mul(dy, y); for `x / y`, dx = div(dy, y)
//! and dy_y = -dx·x/y; for `alpha * x`, dx = scale(dy, alpha); for
//! bias add, dx = dy and dbias = sum_rows(dy); for dropout, dx =
//! dropout(dy) with the same mask.

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{Activation, Binary, DropoutMask, DROPOUT_CONTROL_WORDS};

entry_points! {
    Elementwise {
        ADD_FORWARD = "add_forward",
        SUB_FORWARD = "sub_forward",
        MUL_FORWARD = "mul_forward",
        DIV_FORWARD = "div_forward",
        SCALE_FORWARD = "scale_forward",
        ADD_ASSIGN = "add_assign",
        COPY_VEC4 = "copy_vec4",
        BIAS_ADD_FORWARD = "bias_add_forward",
        RELU_FORWARD = "relu_forward",
        RELU_BACKWARD = "relu_backward",
        GELU_FORWARD = "gelu_forward",
        GELU_BACKWARD = "gelu_backward",
        SIGMOID_FORWARD = "sigmoid_forward",
        SIGMOID_BACKWARD = "sigmoid_backward",
        TANH_FORWARD = "tanh_forward",
        TANH_BACKWARD = "tanh_backward",
        SILU_FORWARD = "silu_forward",
        SILU_BACKWARD = "silu_backward",
        DROPOUT_FORWARD = "dropout_forward",
    }
}

// The op vocabulary lives in `crate::ops`; here only which entry runs each op.
impl Binary {
    fn kernel(self) -> Kernel {
        match self {
            Binary::Add => ADD_FORWARD,
            Binary::Sub => SUB_FORWARD,
            Binary::Mul => MUL_FORWARD,
            Binary::Div => DIV_FORWARD,
        }
    }
}

impl Activation {
    fn kernels(self) -> (Kernel, Kernel) {
        match self {
            Activation::Relu => (RELU_FORWARD, RELU_BACKWARD),
            Activation::Gelu => (GELU_FORWARD, GELU_BACKWARD),
            Activation::Sigmoid => (SIGMOID_FORWARD, SIGMOID_BACKWARD),
            Activation::Tanh => (TANH_FORWARD, TANH_BACKWARD),
            Activation::Silu => (SILU_FORWARD, SILU_BACKWARD),
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ElementwiseParams {
    n: u32,
    cols: u32,
    alpha: f32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct DropoutParams {
    n: u32,
    cols: u32,
    row_width: u32,
    col_offset: u32,
    rows_per_example: u32,
    threshold: u32,
    salt: u32,
    scale: f32,
}

fn same_len(op: &'static str, names: &[(&str, &View<'_>)]) -> Result<()> {
    let n = names[0].1.len;
    if names.iter().any(|(_, v)| v.len != n) {
        let detail: Vec<String> = names.iter().map(|(k, v)| format!("{k}={}", v.len)).collect();
        let shapes: Vec<Vec<usize>> = names.iter().map(|(_, v)| vec![v.len]).collect();
        return Err(Error::Shape {
            op,
            reason: format!("operands must have equal length ({})", detail.join(", ")),
            shapes,
        });
    }
    Ok(())
}

impl Kernels {
    fn flat(
        &self,
        kernel: Kernel,
        out: View<'_>,
        x: View<'_>,
        y: Option<View<'_>>,
        cols: usize,
        alpha: f32,
    ) -> Result<Dispatch> {
        let op = kernel.entry;
        let params = ElementwiseParams {
            n: dim(op, out.len)?,
            cols: dim(op, cols)?,
            alpha,
            _pad: 0,
        };
        let mut bindings = vec![bind(0, "x", x), bind(2, "out", out)];
        if let Some(y) = y {
            bindings.push(bind(1, "y", y));
        }
        self.prepare(kernel, &[], &bindings, 3, &params, flat_groups(out.len))
    }

    /// out = x ∘ y elementwise; all three the same length.
    pub fn binary(&self, op: Binary, out: View<'_>, x: View<'_>, y: View<'_>) -> Result<Dispatch> {
        let kernel = op.kernel();
        same_len(kernel.entry, &[("out", &out), ("x", &x), ("y", &y)])?;
        self.flat(kernel, out, x, Some(y), 1, 0.0)
    }

    /// out = alpha · x.
    pub fn scale(&self, out: View<'_>, x: View<'_>, alpha: f32) -> Result<Dispatch> {
        same_len(SCALE_FORWARD.entry, &[("out", &out), ("x", &x)])?;
        self.flat(SCALE_FORWARD, out, x, None, 1, alpha)
    }

    /// out = x, in 16-byte loads and stores: lengths a multiple of 4 and
    /// offsets 16-byte aligned (an error otherwise). What the bandwidth
    /// bench copies with (`wgrad_benches::CopyBandwidth`).
    pub fn copy_vec4(&self, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        const PER_INVOCATION: usize = 4;
        const WORKGROUP: usize = 64;
        let op = COPY_VEC4.entry;
        same_len(op, &[("out", &out), ("x", &x)])?;
        if x.len % 4 != 0 || x.offset % 16 != 0 || out.offset % 16 != 0 {
            return Err(Error::shape(op, format!("copies whole vec4s: needs a length that is a multiple of 4 and 16-byte aligned offsets; got {} floats, x at byte {}, out at byte {}", x.len, x.offset, out.offset), &[&[x.len], &[out.len]]));
        }
        let params = ElementwiseParams {
            n: dim(op, x.len / 4)?,
            cols: 1,
            alpha: 1.0,
            _pad: 0,
        };
        let groups = (x.len / 4).div_ceil(PER_INVOCATION * WORKGROUP) as u64;
        self.prepare(
            COPY_VEC4,
            &[],
            &[bind(0, "x", x), bind(2, "out", out)],
            3,
            &params,
            groups,
        )
    }

    /// out += x (gradient accumulation).
    pub fn add_assign(&self, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        same_len(ADD_ASSIGN.entry, &[("out", &out), ("x", &x)])?;
        self.flat(ADD_ASSIGN, out, x, None, 1, 0.0)
    }

    /// out[rows, cols] = x[rows, cols] + bias[cols].
    pub fn bias_add(&self, out: View<'_>, x: View<'_>, bias: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        let op = BIAS_ADD_FORWARD.entry;
        if rows.checked_mul(cols) != Some(x.len) || out.len != x.len || bias.len != cols || cols == 0 {
            return Err(Error::shape(
                op,
                format!(
                    "x and out must be rows×cols = {rows}×{cols} and bias cols; got x {}, out {}, bias {}",
                    x.len, out.len, bias.len
                ),
                &[&[rows, cols], &[bias.len], &[out.len]],
            ));
        }
        self.flat(BIAS_ADD_FORWARD, out, x, Some(bias), cols, 0.0)
    }

    /// out = f(x).
    pub fn activation_forward(&self, act: Activation, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        let kernel = act.kernels().0;
        same_len(kernel.entry, &[("out", &out), ("x", &x)])?;
        self.flat(kernel, out, x, None, 1, 0.0)
    }

    /// out = dropout(x) under `mask` ([`DropoutMask`]), x viewed as
    /// [rows, cols] with `rows_per_example` rows to an example; `control`
    /// holds the run's [`DROPOUT_CONTROL_WORDS`] u32 words (key, on, first
    /// example). Also the backward, over dy: the same mask.
    pub fn dropout(
        &self,
        mask: DropoutMask,
        out: View<'_>,
        x: View<'_>,
        control: View<'_>,
        cols: usize,
        rows_per_example: usize,
    ) -> Result<Dispatch> {
        let op = DROPOUT_FORWARD.entry;
        same_len(op, &[("out", &out), ("x", &x)])?;
        mask.check(op, cols)?;
        if x.len % cols != 0 || rows_per_example == 0 || control.len < DROPOUT_CONTROL_WORDS {
            return Err(Error::shape(
                op,
                format!(
                    "x must be rows × {cols} with at least one row per example, and control {DROPOUT_CONTROL_WORDS} words; got x {}, {rows_per_example} rows per example, control {}",
                    x.len, control.len
                ),
                &[&[x.len], &[cols], &[control.len]],
            ));
        }
        let params = DropoutParams {
            n: dim(op, out.len)?,
            cols: dim(op, cols)?,
            row_width: dim(op, mask.row_width)?,
            col_offset: dim(op, mask.col_offset)?,
            rows_per_example: dim(op, rows_per_example)?,
            threshold: mask.threshold(),
            salt: mask.salt,
            scale: mask.scale(),
        };
        let bindings = [bind(0, "x", x), bind(2, "out", out), bind(4, "control", control)];
        self.prepare(DROPOUT_FORWARD, &[], &bindings, 5, &params, flat_groups(out.len))
    }

    /// dx = f'(x) · dy, where x is the forward input.
    pub fn activation_backward(&self, act: Activation, dx: View<'_>, x: View<'_>, dy: View<'_>) -> Result<Dispatch> {
        let kernel = act.kernels().1;
        same_len(kernel.entry, &[("dx", &dx), ("x", &x), ("dy", &dy)])?;
        self.flat(kernel, dx, x, Some(dy), 1, 0.0)
    }
}
