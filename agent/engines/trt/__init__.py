"""The TensorRT build in the build child: a build job in, a serialized engine and its layer placement out."""
