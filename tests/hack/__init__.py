"""Tests of the build scripts in hack/ (the driver image, the CUDA stand-in)."""
