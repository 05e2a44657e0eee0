"""The gpu.scheduling/v1 API: constants, frozen models, codecs. Pure."""
