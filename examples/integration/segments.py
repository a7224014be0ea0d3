"""What an engine parameter holds after an update: its checkpoint tensors
mapped through its segments (docs/protocol.md, "Segments"). Works on numpy
arrays and torch tensors alike; used by the examples to check engines."""


def expected_param(shape, segs, source, name, flat):
    """The parameter `name` of `shape`: source(name) reshaped when it has no
    segments, else `flat` (a 1-D array of the parameter's elements, filled
    in place) with each segment's block of source(segment source) copied
    row by row to dest_offset + i * dest_row_stride."""
    if not segs:
        return source(name).reshape(shape)
    for s in segs:
        src = source(s["source"])
        src = src.reshape(src.shape[0], -1)
        block = src[s["row_begin"]:s["row_begin"] + s["row_count"],
                    s["col_begin"]:s["col_begin"] + s["col_count"]]
        stride = s["dest_row_stride"] or s["col_count"]
        for i in range(s["row_count"]):
            o = s["dest_offset"] + i * stride
            flat[o:o + s["col_count"]] = block[i]
    return flat.reshape(shape)
