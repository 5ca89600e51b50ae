"""Placement economics: KV bytes per token, fetch vs recompute, the fetch gate, capacity.

Library use::

    from kvtier.modelspec import build_catalog
    from kvtier.plan import reports

    m = build_catalog()["llama3.1-70b-instruct"]
    r = reports.gate_report(m, context=8192, prefill_tps=5000,
                            cases=[reports.GateCase("5Gbit/s,20ms", 5e9 / 8, 0.020)])
    print(r.cases[0].verdict)   # recompute

``costs`` holds the formulas, ``capacity`` the sizing, ``measured`` the fetch costs a bench result
measured, ``reports`` the typed answers ``kvtier plan`` prints.
"""
