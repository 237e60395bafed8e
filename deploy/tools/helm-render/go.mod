module gpupool.dev/tools/helm-render

go 1.19
