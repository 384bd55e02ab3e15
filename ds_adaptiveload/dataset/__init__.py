"""Dataset tooling: `manifest` (scan a folder of videos and images into a manifest) and the dataset
`report` (token histogram, bucket table and predicted load per policy). Imports PyAV and matplotlib only
inside the functions that need them."""
