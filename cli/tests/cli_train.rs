//! `wgrad train` failing before it does any work. (The library's checks
//! themselves are in tests/parallel.rs; cli/tests/mpi.rs runs the binary
//! under mpirun.)

use wgrad::parallel::MAX_DEVICES;

/// `Strategy::check_devices` runs before any device opens (the run fails
/// at once, not after opening devices one by one).
#[test]
fn wgrad_train_with_100000_devices_fails_at_once() {
    let dir = std::env::temp_dir().join(format!("wgrad-devices-{}", std::process::id()));
    let (ckpt, plot) = (dir.join("never.safetensors"), dir.join("never.png"));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args(["train", "--parallel", "data", "--devices", "100000", "--max-steps", "1"])
        .arg("--checkpoint")
        .arg(&ckpt)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{err}");
    assert!(err.contains("100000") && err.contains(&MAX_DEVICES.to_string()), "{err}");
    assert!(!ckpt.exists());
}
