fn main() {
    // The real library's SONAME, so programs linked against the fake record `libnvidia-ml.so.1`.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
}
