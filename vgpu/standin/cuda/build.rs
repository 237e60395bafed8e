//! The stand-in is loaded as `libcuda.so.1`, so that is its SONAME. `-Bsymbolic` binds its own
//! references to its own definitions: the addresses `cuGetProcAddress` returns are always this
//! library's exported symbols, even when a preloaded library exports the same names.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
}
