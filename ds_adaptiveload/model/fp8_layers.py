"""torchao Float8Linear for the DiT's two nn.Linear subclasses whose input is not what their weight multiplies
(imported only where torchao is installed: model/fp8.py converts, then adopts these).

- RowsLinear (attention output `o`) may take a list of per-group attention outputs: merged into [T, dim] rows first.
- GeluLinear (FFN `ffn.2`) takes the pre-activation h and multiplies gelu(h): the GELU runs before the fp8 GEMM.
  Unlike the bf16 gelu_linear op, Float8Linear keeps gelu(h) for its backward besides h for GELU's: one more
  [T, ffn_dim] tensor per block that is not checkpointed.
Neither holds state beyond Float8Linear's, so the converted module's class is switched in place.
"""
import torch.nn.functional as F
from torchao.float8.float8_linear import Float8Linear

from ds_adaptiveload.model.gelu_linear import GeluLinear
from ds_adaptiveload.model.packed_ops import RowsLinear
from ds_adaptiveload.model.packing import merge


class Float8RowsLinear(Float8Linear):
    """Float8Linear taking RowsLinear's inputs: a tensor, or a list of parts [n_g, local, ..., in] merged into rows."""

    def forward(self, x):
        if isinstance(x, (list, tuple)):
            x = merge(x).flatten(1)
        return self.project(x)

    def project(self, x):
        """The fp8 GEMM over rows; compile_regions binds a compiled Float8Linear.forward here."""
        return Float8Linear.forward(self, x)


class Float8GeluLinear(Float8Linear):
    """Float8Linear of gelu_tanh(h), as GeluLinear computes in bf16."""

    def forward(self, h):
        return Float8Linear.forward(self, F.gelu(h, approximate="tanh"))


ADOPTED = {RowsLinear: Float8RowsLinear, GeluLinear: Float8GeluLinear}


def adopt(module, original: type) -> None:
    """Give the Float8Linear that replaced a module of class `original` the forward that class needs."""
    if original in ADOPTED:
        module.__class__ = ADOPTED[original]
