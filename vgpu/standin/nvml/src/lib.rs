//! Test-only: a stand-in libnvidia-ml.so.1.
