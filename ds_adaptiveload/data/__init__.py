"""Data: the latent shard format, LatentDataset and MicroBatchStream (latents), `synthesize`, the `manifest`
scan of a media folder (scan) and the dataset report (report). PyAV and matplotlib are imported only inside
the functions that need them."""
