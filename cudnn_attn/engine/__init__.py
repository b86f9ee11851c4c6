"""Running prepared calls: device contexts, launches, CUDA-graph replay, the graph cache."""
