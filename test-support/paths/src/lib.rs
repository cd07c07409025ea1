//! Where a test's files are, read at run time.
//!
//! A path compiled in with `env!("CARGO_MANIFEST_DIR")` is the checkout the binary was built in.
//! Cargo reuses a built test across checkouts that share a target directory (a CI clone and a
//! working tree: `.ci/run` keeps its target outside the clone), so such a test reads the other
//! checkout's files, or fails when that checkout is gone. Cargo sets `CARGO_MANIFEST_DIR` in
//! the environment of every test and bench it runs, for the package under test.

use std::path::{Path, PathBuf};

/// The directory of the package whose test or bench is running.
///
/// # Panics
/// When the binary was not started by cargo (`cargo test`, `cargo bench`), which sets it.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .expect("CARGO_MANIFEST_DIR is set: run the tests through cargo")
}

/// The workspace root: the nearest directory above [`manifest_dir`] with a `Cargo.lock`.
///
/// # Panics
/// As [`manifest_dir`], or when no such directory exists.
pub fn workspace_root() -> PathBuf {
    let dir = manifest_dir();
    dir.ancestors()
        .find(|d| d.join("Cargo.lock").is_file())
        .map(Path::to_path_buf)
        .expect("the package is inside a workspace with a Cargo.lock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_holds_this_package() {
        assert!(manifest_dir().join("src/lib.rs").is_file());
        assert!(
            workspace_root()
                .join("test-support/paths/Cargo.toml")
                .is_file()
        );
    }
}
