"""The placement service: watches worker heartbeats, migrates requests between decode workers
(Llumnix's load balancing and drains) and advises on scaling; one leader at a time."""
