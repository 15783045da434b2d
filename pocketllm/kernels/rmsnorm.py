"""RMSNorm over the last dimension (also used per head for the q/k norm).

The Hugging Face Qwen convention: normalise in fp32, cast back to the input dtype, then scale.
"""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H]; each row is reduced on its own, so rows never influence each other."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
