//! A hub model spec resolves from the Hugging Face cache that `HF_HOME` names, without a network
//! (its own test binary: it sets the process's environment).

use spade_engine::ModelSource;
use spade_test_support::models::{model_path, TINY};

#[test]
fn hub_files_are_found_in_the_cache_hf_home_names() {
    let home = std::env::temp_dir().join(format!("spade-hf-home-{}", std::process::id()));
    let repo = home.join("hub").join("models--spade-test--tiny");
    let snapshot = repo.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "0123abcd").unwrap();
    let file = snapshot.join("tiny.gguf");
    let _ = std::fs::remove_file(&file);
    std::os::unix::fs::symlink(model_path(TINY), &file).unwrap();
    // Nothing answers on this endpoint: only the cache can resolve the file.
    std::env::set_var("HF_ENDPOINT", "http://127.0.0.1:9");
    std::env::set_var("HF_HOME", &home);

    let source = ModelSource::parse("spade-test/tiny:tiny.gguf").unwrap();
    assert_eq!(source.resolve().unwrap(), file);
    let missing = ModelSource::parse("spade-test/tiny:other.gguf").unwrap().resolve().unwrap_err();
    assert!(missing.to_string().contains("other.gguf"), "{missing}");
    std::fs::remove_dir_all(&home).unwrap();
}
