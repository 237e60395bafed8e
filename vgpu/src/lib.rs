//! gpupool-vgpu: the enforcement library preloaded into every limited container (docs/enforcement.md).
