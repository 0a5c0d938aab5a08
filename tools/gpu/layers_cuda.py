"""The layers stage with the reference on the GPU (issue 35): a healthy engine and one with
permuted experts in layer 3 (its weights hidden, so the layers stage must name it)."""

import sys

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.testing.faults import make_faulty_engine

path = sys.argv[1]
for fault in (None, "experts-permuted"):
    opts = DiagnoseOptions(model=path, max_prompts=2, max_tokens=20, sanity=False, decode_to=0, sweep_to=0,
                           reference_device="cuda", engine=None if fault else "reference:fp32")
    if fault:
        with make_faulty_engine(fault, path, layer=3, expose_weights=False) as engine:
            d = diagnose(opts, engine=engine)
    else:
        d = diagnose(opts)
    print(fault, "->", d.verdict.component, d.verdict.layer, d.verdict.message[:200], d.verdict.errors[:2],
          "reference on", d.resources.device)
