"""The position grid of the invariance contract, in the lowest layer so every layer reads one value.

Prefill pieces are cut, and reused prefixes rounded down, only at request-local multiples of
POSITION_GRID: the Gated DeltaNet chunk (`_gated_delta.CHUNK_SIZE`) is this grid, so a cut there
leaves every chunk whole; the lab cuts its split checks on it; chunk sizes and snapshot intervals
in `backend_options` are multiples of it.
"""

POSITION_GRID = 64
