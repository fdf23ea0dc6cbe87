// THROWAWAY: kernel exploration harness (to be deleted).
use std::time::Instant;
use wgpu::util::DeviceExt;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct P { m: u32, n: u32, k: u32, tiles_n: u32, tiles_total: u32, pad: [u32; 3] }

fn cpu(ta: bool, tb: bool, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m { for j in 0..n { let mut s = 0f64; for p in 0..k {
        let av = if ta { a[p * m + i] } else { a[i * k + p] };
        let bv = if tb { b[j * k + p] } else { b[p * n + j] };
        s += av as f64 * bv as f64; } c[i * n + j] = s as f32; } }
    c
}

fn main() {
    let inst = wgpu::Instance::new({ let mut d = wgpu::InstanceDescriptor::new_without_display_handle(); d.backends = wgpu::Backends::VULKAN; d });
    let adapter = pollster::block_on(inst.request_adapter(&wgpu::RequestAdapterOptions::default())).unwrap();
    eprintln!("{}", adapter.get_info().name);
    let mut limits = wgpu::Limits::default();
    limits.max_storage_buffer_binding_size = adapter.limits().max_storage_buffer_binding_size;
    limits.max_buffer_size = adapter.limits().max_buffer_size;
    let (dev, q) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor { required_limits: limits, ..Default::default() })).unwrap();
    let timen: usize = std::env::var("N").ok().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let forms: Vec<(bool, bool)> = match std::env::var("FORMS").as_deref() { Ok("all") => vec![(false,false),(true,false),(false,true)], _ => vec![(false,false)] };
    for path in std::env::args().skip(1) {
        let src = std::fs::read_to_string(&path).unwrap();
        let tile: usize = src.lines().find_map(|l| l.trim().strip_prefix("const TILE: u32 = ").map(|r| r.trim_end_matches("u;").parse().unwrap())).unwrap();
        let module = dev.create_shader_module(wgpu::ShaderModuleDescriptor { label: None, source: wgpu::ShaderSource::Wgsl(src.into()) });
        let mut ok = true;
        let run = |ta: bool, tb: bool, m: usize, n: usize, k: usize, a: &[f32], b: &[f32], reps: usize, read: bool| -> (f64, Vec<f32>) {
            let consts = [("TRANS_A", ta as u8 as f64), ("TRANS_B", tb as u8 as f64)];
            let pl = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor { label: None, layout: None, module: &module, entry_point: Some("matmul_forward_register"), compilation_options: wgpu::PipelineCompilationOptions { constants: &consts, zero_initialize_workgroup_memory: false }, cache: None });
            let u = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
            let ab = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(a), usage: u });
            let bb = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(b), usage: u });
            let cb = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(&vec![f32::NAN; m * n]), usage: u });
            let tn = n.div_ceil(tile); let tt = tn * m.div_ceil(tile);
            let p = P { m: m as u32, n: n as u32, k: k as u32, tiles_n: tn as u32, tiles_total: tt as u32, pad: [0; 3] };
            let pb = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::bytes_of(&p), usage: wgpu::BufferUsages::UNIFORM });
            let bg = dev.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &pl.get_bind_group_layout(0), entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: ab.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: bb.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: cb.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 3, resource: pb.as_entire_binding() }] });
            let go = || { let mut e = dev.create_command_encoder(&Default::default()); { let mut pass = e.begin_compute_pass(&Default::default()); pass.set_pipeline(&pl); pass.set_bind_group(0, &bg, &[]); pass.dispatch_workgroups(tt as u32, 1, 1); } q.submit([e.finish()]); };
            go(); dev.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            let mut best = Vec::new();
            for _ in 0..reps { let t = Instant::now(); go(); dev.poll(wgpu::PollType::wait_indefinitely()).unwrap(); best.push(t.elapsed().as_secs_f64()); }
            best.sort_by(|a, b| a.total_cmp(b));
            let med = if reps > 0 { best[reps / 2] } else { 0.0 };
            let mut out = Vec::new();
            if read {
                let st = dev.create_buffer(&wgpu::BufferDescriptor { label: None, size: (m * n * 4) as u64, usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST, mapped_at_creation: false });
                let mut e = dev.create_command_encoder(&Default::default()); e.copy_buffer_to_buffer(&cb, 0, &st, 0, (m * n * 4) as u64); q.submit([e.finish()]);
                st.slice(..).map_async(wgpu::MapMode::Read, |_| {}); dev.poll(wgpu::PollType::wait_indefinitely()).unwrap();
                out = bytemuck::cast_slice(&st.slice(..).get_mapped_range().unwrap()).to_vec();
            }
            (med, out)
        };
        let mut seed = 1u32;
        let mut rnd = |len: usize| -> Vec<f32> { (0..len).map(|_| { seed = seed.wrapping_mul(1664525).wrapping_add(1013904223); (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0 }).collect() };
        if std::env::var("NOCHECK").is_err() {
            for &(m, n, k) in &[(1, 1, 1), (7, 13, 5), (65, 130, 67), (200, 3, 1000), (64, 64, 64), (129, 257, 33), (3, 200, 17), (130, 70, 2)] {
                for &(ta, tb) in &[(false, false), (true, false), (false, true)] {
                    let a = rnd(m * k); let b = rnd(k * n);
                    let (_, g) = run(ta, tb, m, n, k, &a, &b, 0, true);
                    let r = cpu(ta, tb, m, n, k, &a, &b);
                    let err = g.iter().zip(&r).map(|(x, y)| (x - y).abs()).fold(0f32, |a, b| if b.is_nan() || a.is_nan() { f32::NAN } else { a.max(b) });
                    if !(err < 1e-4 * (k as f32).max(1.0)) { ok = false; eprintln!("  FAIL {path} ({m},{n},{k}) ta={ta} tb={tb} err={err}"); }
                }
            }
        }
        for &(ta, tb) in &forms {
            let a = rnd(timen * timen); let b = rnd(timen * timen);
            let (t, _) = run(ta, tb, timen, timen, timen, &a, &b, 5, false);
            println!("{path} ta={ta} tb={tb} n={timen} ok={ok} gflops={:.2}", 2.0 * (timen as f64).powi(3) / t / 1e9);
        }
    }
}
