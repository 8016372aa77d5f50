//! Writes the seed corpus: `fuzz/corpus/<target>/seed-<n>` for every target.
//! Run from `fuzz/`: `cargo run --bin write_seeds` (stable is enough).

use std::path::Path;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, seeds) in kv_descriptor_fuzz::seeds::by_target() {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        for (i, bytes) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), bytes)?;
        }
        println!("{target}: {} seeds in {}", seeds.len(), dir.display());
    }
    Ok(())
}
