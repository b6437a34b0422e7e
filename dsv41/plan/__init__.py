"""The cost model: weight and cache sizing, per-node costs, device profiles, the roofline and the
full-scale plan of a step on meta tensors, and the per-card HBM ledger (values by graph liveness)
that both the plan and a traced run keep. Reads the graph; knows nothing of tracing."""
