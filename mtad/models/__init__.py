"""The model side: pairs and their presets, devices and dtypes, the CPU kernels, the shortlist draft, GGUF.

Importing this package (any module of it) registers the shortlist draft (``model_type = "mtad_shortlist"``)
with transformers' Auto classes, so ``AutoModelForCausalLM.from_pretrained`` loads such a draft without
remote code.
"""

from mtad.models import shortlist_draft  # noqa: F401  (registers the draft's classes)
