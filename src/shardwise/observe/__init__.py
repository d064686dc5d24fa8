"""Seeing where a run's time and memory go: profiler traces, their analysis, experiment trackers.

``profiler`` drives ``torch.profiler`` (and the CUDA memory snapshot) over a window of steps,
``trace`` reads the Chrome/Perfetto traces it writes back into a compute / communication / data
split and a top-ops table, ``trackers`` feeds TensorBoard, W&B, MLflow and CSV from rank 0, and
``hooks`` is the one object the trainer calls at start, after each step, per logged record and at
the end.
"""
