"""Development tools: stand-ins and instruments at the gateway's side, and the demo.

Not part of the product: the wheel ships `queue_store`, `flows` and
`deployments` only. The tests, the benchmarks and `make demo` use these from
the checkout.
"""
