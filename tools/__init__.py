"""Tools over the stages: inspection of a `.om` (om_tools: info, validate, dump; listing;
alloc_profile), export to ONNX (export_onnx), and verification of a `.om` against its
source model (verify), which uses both the compiler's frontends and the runtime."""
