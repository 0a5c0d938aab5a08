"""The checks, one module per stage (file, sharding, weights, layers, logits / paths)."""


def index_ranges(indices) -> str:
    """[0, 1, 2, 5, 40] -> '0-2, 5, 40' (layers or experts a report names)."""
    out, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
