"""The loop's I/O: checkpoints, the workdir, metric writers (JSONL, TensorBoard, W&B)."""
