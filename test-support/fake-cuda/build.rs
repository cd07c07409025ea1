fn main() {
    // The real library's SONAME, so programs linked against the fake record `libcuda.so.1`.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
