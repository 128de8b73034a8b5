"""``deepinfer cluster``: many engines behind one address, on Ray Serve.

::

    client ──HTTP──> ingress (the same routes as ``deepinfer serve``; tokenizes, hashes the prompt)
                        │  prefill job (uncached prompt)          │  decode job (whole prompt)
                        ▼  PrefillRouter: tier, prefix, override  ▼  DecodeRouter: even out resident KV
                     prefill replicas ──blocks──> KV store ──blocks──> decode replicas ──tokens──> client

The policies are pure modules (:mod:`.router`, :mod:`.autoscaler`) that know nothing of Ray;
:mod:`.ray_glue` adapts them to Ray Serve's request router and autoscaling policy, and
:mod:`.replica` / :mod:`.ingress` are the deployments. Only the ingress and the replicas import
Ray, so the policies' tests (and the simulator) run without it.
"""
