"""Tokenizer and processor loading and image encoding, where slime's plug-ins import them
(``slime.utils.processing_utils`` → ``vime.utils.processing_utils``).

vime trains text-only models: :func:`load_processor` returns ``None`` for a checkpoint without a multimodal
processor (as slime's does), and an SGLang request carrying images is refused by the ``/generate`` translation
(:mod:`vime.utils.sglang_compat`) with the field's name, so an image never goes silently unused.
"""

from __future__ import annotations

import base64
import io
import logging
from pathlib import Path
from typing import Any

from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase, ProcessorMixin

logger = logging.getLogger(__name__)

# Files a Hugging Face checkpoint with an image/video/audio processor carries (a text model has none of them).
_PROCESSOR_FILES = (
    "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
    "feature_extractor_config.json",
)  # fmt: skip
_MODALITY_KWARGS = ("audio_kwargs", "images_kwargs", "videos_kwargs")


def load_tokenizer(name_or_path: str, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(name_or_path, **kwargs)`` (slime's helper; a new tokenizer per call)."""
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any):
    """The checkpoint's multimodal processor, or ``None`` for a text-only model (a local checkpoint without any
    processor config file, or one whose ``AutoProcessor`` is only its tokenizer), as slime's."""
    local = Path(name_or_path)
    if local.is_dir() and not any((local / name).exists() for name in _PROCESSOR_FILES):
        return None
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as exc:  # no processor to load: a text model
        logger.info("no multimodal processor for %s (%s); text only", name_or_path, exc)
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or not isinstance(processor, ProcessorMixin):
        return None
    return processor


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """Keyword arguments for ``processor(text=..., **kwargs)`` from a sample's multimodal inputs (slime's): the
    inputs themselves, text outputs as plain lists (no tensors, no token-type ids) and every modality's outputs as
    PyTorch tensors; per-modality kwargs already given are kept, with those two settings forced."""
    kwargs = dict(multimodal_inputs or {})
    kwargs["text_kwargs"] = {
        **kwargs.get("text_kwargs", {}),
        "return_tensors": None,
        "return_mm_token_type_ids": False,
    }
    for key in _MODALITY_KWARGS:
        kwargs[key] = {**kwargs.get(key, {}), "return_tensors": "pt"}
    return kwargs


def encode_image_for_rollout_engine(image) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URI (converted to RGB first), as SGLang's ``image_data``
    takes it (slime's helper; vime's engines take no images: the request that carries one is refused)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
