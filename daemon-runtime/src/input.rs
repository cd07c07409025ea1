//! Reading a file named on the command line, where `-` means standard input (`simulate -f -`,
//! `kubectl tessera plan -f -`).

use std::path::{Path, PathBuf};

/// A file (or standard input) that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading standard input")]
    Stdin(#[source] std::io::Error),
    #[error("reading {}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The text of `path`, or of standard input when `path` is `-`.
pub fn read_file_or_stdin(path: &Path) -> Result<String, ReadError> {
    if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).map_err(ReadError::Stdin)
    } else {
        std::fs::read_to_string(path).map_err(|source| ReadError::File {
            path: path.to_owned(),
            source,
        })
    }
}
