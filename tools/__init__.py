"""Tools beside the deployable runtime: the benchmark and its peers, acceptance, the GPU check and its projection."""
