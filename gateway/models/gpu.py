"""GPU models for the ``torch`` backend: BERT-base and ResNet-50, random weights, built from their configs.

For the GPU-tier check (``bench/gpu_tier.py``): the architectures of the production models, initialised at
random (nothing is downloaded; transformers and timm build them from a config). Both use the generic
``tensor`` pipeline: ``bert-base`` takes ``input_ids``/``attention_mask`` INT64 [128] and answers the pooled
``embedding`` [768]; ``resnet50`` takes ``pixels`` FP16 [3, 224, 224] and answers ``logits`` [1000].
"""

from __future__ import annotations

import importlib
from typing import Any, Final

from gateway.backends.torch import TorchModel
from inference.backends.base import ModelSpec, TensorSpec

BERT_SEQ: Final = 128
MAX_BATCH: Final = 128


def bert_base(device: str, dtype: str) -> TorchModel:
    """BERT-base (12 layers, 768 wide) with random weights."""
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval().to(device, getattr(torch, dtype))

    def embed(input_ids: Any, attention_mask: Any) -> dict[str, Any]:
        return {"embedding": model(input_ids=input_ids, attention_mask=attention_mask).pooler_output}

    spec = ModelSpec(
        name="bert-base",
        version="1",
        inputs=(
            TensorSpec("input_ids", "int64", (BERT_SEQ,)),
            TensorSpec("attention_mask", "int64", (BERT_SEQ,)),
        ),
        outputs=(TensorSpec("embedding", "float32", (768,)),),
        max_batch_size=MAX_BATCH,
        pipeline="tensor",
    )
    return TorchModel(spec, embed)


def resnet50(device: str, dtype: str) -> TorchModel:
    """ResNet-50 (timm's) with random weights, channels-last."""
    torch = importlib.import_module("torch")
    timm = importlib.import_module("timm")
    torch.manual_seed(0)
    net = timm.create_model("resnet50", pretrained=False).eval()
    net = net.to(device, getattr(torch, dtype), memory_format=torch.channels_last)

    def classify(pixels: Any) -> dict[str, Any]:
        return {"logits": net(pixels.contiguous(memory_format=torch.channels_last))}

    spec = ModelSpec(
        name="resnet50",
        version="1",
        inputs=(TensorSpec("pixels", "float16", (3, 224, 224)),),
        outputs=(TensorSpec("logits", "float32", (1000,)),),
        max_batch_size=MAX_BATCH,
        pipeline="tensor",
    )
    return TorchModel(spec, classify)
