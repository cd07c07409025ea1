//! TLS material loading and reload.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tessera_scheduler::tls::{TlsFiles, load, watch_reload};

fn write_pair(dir: &std::path::Path, name: &str) -> TlsFiles {
    let ck = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
    let cert = dir.join("tls.crt");
    let key = dir.join("tls.key");
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    TlsFiles { cert, key, client_ca: None }
}

#[test]
fn a_valid_pair_loads_with_and_without_a_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = write_pair(dir.path(), "localhost");
    assert!(load(&files).is_ok());
    files.client_ca = Some(files.cert.clone());
    assert!(load(&files).is_ok());
}

#[test]
fn missing_or_empty_files_are_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = write_pair(dir.path(), "localhost");
    files.key = dir.path().join("absent.key");
    let e = load(&files).unwrap_err().to_string();
    assert!(e.contains("absent.key"), "{e}");
    let files = write_pair(dir.path(), "localhost");
    std::fs::write(&files.cert, "").unwrap();
    let e = load(&files).unwrap_err().to_string();
    assert!(e.contains("no PEM certificate"), "{e}");
}

#[tokio::test]
async fn a_changed_certificate_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_pair(dir.path(), "old.example");
    let current = Arc::new(RwLock::new(load(&files).unwrap()));
    let before = Arc::as_ptr(&current.read().unwrap().clone());
    tokio::spawn(watch_reload(files.clone(), current.clone(), Duration::from_millis(20)));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    write_pair(dir.path(), "new.example");
    let mut swapped = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if Arc::as_ptr(&current.read().unwrap().clone()) != before {
            swapped = true;
            break;
        }
    }
    assert!(swapped, "configuration was not reloaded");
}
