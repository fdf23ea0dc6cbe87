//! Nothing but the benches under `benches/` (this package exists so that
//! `cargo test` in the workspace does not build criterion).
