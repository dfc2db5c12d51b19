"""The capture: what a checkpoint takes (the registered state), the snapshot into reused buffers on
the CPU or a GPU (the device's calls behind one interface, the staging buffer, the GPU's waits), the
fence before the next optimizer step, and the background writer thread that drains a snapshot."""
