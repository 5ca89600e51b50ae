"""What users ask for: profiles, QoS classes and the requests they generate. No I/O here."""
