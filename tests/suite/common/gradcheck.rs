//! Gradient checks shared by the test files: the graph's gradients from the
//! GPU against f64 central differences of `Graph::evaluate_f64` and every
//! backward node against its own reference (`gradcheck`), central
//! differences of a CPU twin (`central_differences`), and the small
//! builders their cases use. A family's test file checks its ops' kernels
//! against the twins and their gradients with these.

use std::sync::Arc;

use super::{assert_close, random_vec, rng};
use wgrad::graph::{Executor, Graph, Tensor};
use wgrad::Kernels;

/// Checks d loss / d param from the GPU against f64 central differences.
pub fn gradcheck(
    k: &Arc<Kernels>,
    what: &str,
    mut g: Graph,
    loss: Tensor,
    feeds: Vec<(Tensor, Vec<f32>)>,
    labels: Vec<(Tensor, Vec<u32>)>,
) -> wgrad::Result<()> {
    let grads = g.backward(loss)?;
    // Frozen parameters (a quantized or f16 weight) have no gradient.
    let params = g.trainable_parameters();
    let reference = g.clone();
    let mut exec = Executor::new(k.clone(), g, &[loss], Some(grads.clone()), None)?;
    for (t, d) in &feeds {
        exec.set_input(*t, d)?;
    }
    for (t, l) in &labels {
        exec.set_labels(*t, l)?;
    }
    exec.train_step(true, false, false)?;
    // The f64 reference takes ids and labels as their integer values.
    let feeds64: Vec<(Tensor, Vec<f64>)> = feeds
        .iter()
        .map(|(t, d)| (*t, d.iter().map(|&v| f64::from(v)).collect()))
        .chain(
            labels
                .iter()
                .map(|(t, l)| (*t, l.iter().map(|&v| f64::from(v)).collect())),
        )
        .collect();
    for p in params {
        let got = exec.read_grad(p)?;
        let name = &reference.get(p).expect("parameter").name;
        // The backward nodes' own CPU references, evaluated in f64: the
        // f32 kernels' rounding is all that differs.
        let grad_node = grads.get(p).expect("the loss depends on every parameter");
        let backward: Vec<f32> = reference.evaluate_f64(&[grad_node], &feeds64)?[0]
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert_close(
            &format!("{what}: d/d {name}, the backward graph's references"),
            &got,
            &backward,
            1e-4,
            1e-3,
        );
        let mut want = Vec::with_capacity(got.len());
        let eps = 1e-4;
        for i in 0..got.len() {
            let mut plus = reference.clone();
            let mut minus = reference.clone();
            let a = plus.parameter_init_mut(p).expect("parameter");
            a[i] += eps as f32;
            let up = a[i];
            let b = minus.parameter_init_mut(p).expect("parameter");
            b[i] -= eps as f32;
            // The perturbation is applied in f32; divide by the actual step.
            let step = f64::from(up) - f64::from(b[i]);
            let lp = plus.evaluate_f64(&[loss], &feeds64)?[0][0];
            let lm = minus.evaluate_f64(&[loss], &feeds64)?[0][0];
            want.push(((lp - lm) / step) as f32);
        }
        // f32 GPU gradient vs f64 differences of an f32-perturbed parameter:
        // the difference quotient carries ~1e-4 relative error.
        assert_close(&format!("{what}: d/d {name}"), &got, &want, 2e-3, 1e-2);
    }
    Ok(())
}

/// A trainable tensor of `shape` with values uniform in [-1, 1).
pub fn param(g: &mut Graph, name: &str, shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    g.parameter(name, shape, random_vec(&mut rng(seed), n, -1.0, 1.0))
        .unwrap()
}

/// A trainable tensor of `shape` with values uniform in [low, high).
pub fn param_in(g: &mut Graph, name: &str, shape: &[usize], seed: u64, low: f32, high: f32) -> Tensor {
    let n = shape.iter().product();
    g.parameter(name, shape, random_vec(&mut rng(seed), n, low, high))
        .unwrap()
}

/// An MSE loss of `y` against random targets, and its feed.
pub fn mse_to_random(g: &mut Graph, y: Tensor, seed: u64) -> wgrad::Result<(Tensor, Vec<(Tensor, Vec<f32>)>)> {
    let shape = g.shape_of(y).expect("own tensor").to_vec();
    let n = shape.iter().product();
    let t = g.input("t", &shape)?;
    let loss = g.mse_loss(y, t)?;
    Ok((loss, vec![(t, random_vec(&mut rng(seed), n, -1.0, 1.0))]))
}

/// Central differences of the f64 function `f` at `at` (step `h`),
/// each component weighted by `weights` and summed: ∂(Σ weights·f)/∂at.
pub fn central_differences(at: &[f64], weights: &[f64], h: f64, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f32> {
    let loss = |v: &[f64]| f(v).iter().zip(weights).map(|(a, b)| a * b).sum::<f64>();
    (0..at.len())
        .map(|i| {
            let (mut up, mut down) = (at.to_vec(), at.to_vec());
            up[i] += h;
            down[i] -= h;
            ((loss(&up) - loss(&down)) / (2.0 * h)) as f32
        })
        .collect()
}

/// f32 values as f64, for the twins' f64 evaluation.
pub fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&e| f64::from(e)).collect()
}
