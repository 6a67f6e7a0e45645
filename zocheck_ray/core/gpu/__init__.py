"""The GPU kernels (Triton: the same bits as the CPU oracle on CUDA) and their start-up guard."""
