"""Triton helpers of the chunked gated delta rule (`gated_delta_prefill`): the inverse of a chunk's
unit lower triangular UT transform, in blocks of 16 rows, and a chunk-long product in groups of 16.

Both are fixed-shape arithmetic: every chunk runs the same instructions, whatever its contents.
"""

from ._triton import tl, triton


@triton.jit
def rows_product(a, b, CHUNK: tl.constexpr, WIDTH: tl.constexpr):
    """a [CHUNK, CHUNK] @ b [CHUNK, WIDTH] as batched dots over groups of 16 rows of b (K = 16),
    summed in group order: a single dot with K = CHUNK would hold 64-long operand rows per thread."""
    a_groups = tl.permute(tl.reshape(a, [CHUNK, CHUNK // 16, 16]), [1, 0, 2])
    b_groups = tl.reshape(b, [CHUNK // 16, 16, WIDTH])
    return tl.sum(tl.dot(a_groups, b_groups, input_precision="ieee"), axis=0)


@triton.jit
def unit_lower_inverse(lower, CHUNK: tl.constexpr):
    """(I + lower)^-1 [CHUNK, CHUNK] for lower strictly lower triangular, in blocks of 16 rows: a
    serial chain of 15 + CHUNK / 16 steps, not CHUNK - 1. The inverses of the diagonal blocks
    (I + D_b) are formed together by forward substitution; then, block row after block row, rows b of
    the inverse are (I + D_b)^-1 times rows b of I less L's block row b times the rows above (taken
    out of the rows below as each block row is found)."""
    BLOCKS: tl.constexpr = CHUNK // 16
    i16 = tl.arange(0, 16)
    block = tl.arange(0, BLOCKS)
    same_block = block[:, None, None, None] == block[None, None, :, None]
    diagonal = tl.sum(tl.where(same_block, tl.reshape(lower, [BLOCKS, 16, BLOCKS, 16]), 0.0), axis=2)
    # Row i of (I + D)^-1 is e_i - sum_{j < i} D[i, j] row j (rows from i on still hold the identity).
    identity = tl.where(i16[:, None] == i16[None, :], 1.0, 0.0) + tl.zeros([BLOCKS, 16, 16], dtype=tl.float32)
    diagonal_inverse = identity
    for i in range(1, 16):
        rows = identity - tl.dot(diagonal, diagonal_inverse, input_precision="ieee")
        diagonal_inverse = tl.where(i16[None, :, None] == i, rows, diagonal_inverse)
    r = tl.arange(0, CHUNK)
    columns = tl.reshape(tl.where(r[:, None] // 16 > r[None, :] // 16, lower, 0.0), [CHUNK, BLOCKS, 16])
    rhs = tl.reshape(tl.where(r[:, None] == r[None, :], 1.0, 0.0), [BLOCKS, 16, CHUNK])
    inverse = tl.zeros([BLOCKS, 16, CHUNK], dtype=tl.float32)
    for b in tl.static_range(BLOCKS):  # block row b of rhs is final once the rows above are taken out
        rows = tl.dot(tl.sum(tl.where(block[:, None, None] == b, diagonal_inverse, 0.0), axis=0),
                      tl.sum(tl.where(block[:, None, None] == b, rhs, 0.0), axis=0), input_precision="ieee")
        inverse = tl.where(block[:, None, None] == b, rows[None, :, :], inverse)
        l_b = tl.sum(tl.where(block[None, :, None] == b, columns, 0.0), axis=1)  # L's column block b, below it
        rhs -= tl.reshape(tl.dot(l_b, rows, input_precision="ieee"), [BLOCKS, 16, CHUNK])
    return tl.reshape(inverse, [CHUNK, CHUNK])
