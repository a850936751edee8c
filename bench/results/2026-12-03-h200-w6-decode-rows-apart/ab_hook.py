import os

# AB_DECODE_ROWS_APART=1: a mixed step's decode rows through the decode kernel (a second
# launch), the rest through the prefill kernel (paged_attention's decode_rows_apart, at
# 00c771e).
if os.environ.get("AB_DECODE_ROWS_APART"):
    import functools as _ft7
    import csrc_triton as _ct7

    _ct7.paged_attention = _ft7.partial(_ct7.paged_attention, decode_rows_apart=True)
