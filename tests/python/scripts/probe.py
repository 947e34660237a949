"""Reports what this interpreter offers the GPU tests: torch and its CUDA
devices, streamalloc's compiled parts, torchvision. Touches no GPU memory."""

import importlib
import os
import sys

from _common import emit

result = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as error:
    result.update(torch=None, torch_error=f"{type(error).__name__}: {error}")
else:
    result.update(torch=torch.__version__, cuda=torch.cuda.is_available(), devices=torch.cuda.device_count())
    try:
        importlib.import_module("streamalloc._C")
        result["extension"] = True
    except Exception as error:
        result.update(extension=False, extension_error=f"{type(error).__name__}: {error}")
    try:
        import torchvision

        result["torchvision"] = torchvision.__version__
    except Exception as error:
        result.update(torchvision=None, torchvision_error=f"{type(error).__name__}: {error}")

import streamalloc  # noqa: E402  (after torch, as a user would)

result["package"] = os.path.dirname(streamalloc.__file__)
try:
    result["library"] = streamalloc.library_path()
except RuntimeError as error:
    result.update(library=None, library_error=str(error))
emit(result)
