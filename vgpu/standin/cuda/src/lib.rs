//! Test-only: a stand-in libcuda.so.1.
