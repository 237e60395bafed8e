//! Test-only: the simulated GPU shared by the stand-in CUDA driver and NVML.
