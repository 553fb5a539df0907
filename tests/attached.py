"""A Delivery with its readers attached, for the delivery and reader tests."""


def attached(impl, readers, waker):
    """impl.Delivery(len(readers), waker) with readers[s] (Readers or ResultBuffers) attached to slot s."""
    dl = impl.Delivery(len(readers), waker)
    for s, r in enumerate(readers):
        dl.attach(s, r)
    return dl
