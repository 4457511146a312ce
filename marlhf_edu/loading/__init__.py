"""Where models come from and how they load: asset paths, the one resolver of model references, the model
cache, quantization, devices, adapter and score-head checks."""
