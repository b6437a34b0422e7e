"""The cost model: weight and cache sizing, per-node costs, device profiles, the roofline and the
full-scale plan of a step on meta tensors. Reads the graph; knows nothing of tracing."""
