//! Per-sequence key/value cache: contiguous K and V per layer, grown as tokens arrive.
//! (The paged cache with prefix sharing replaces this in the engine issue.)

#[derive(Debug)]
pub struct KvCache {
    kv_dim: usize,
    len: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvCache {
    pub fn new(n_layers: usize, kv_dim: usize) -> Self {
        Self {
            kv_dim,
            len: 0,
            layers: (0..n_layers).map(|_| (Vec::new(), Vec::new())).collect(),
        }
    }

    /// Tokens whose K/V are committed.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends K/V rows for layer `l`; visible to attention at once, counted by `commit`.
    pub fn append(&mut self, l: usize, k: &[f32], v: &[f32]) {
        let (ks, vs) = &mut self.layers[l];
        ks.truncate(self.len * self.kv_dim);
        vs.truncate(self.len * self.kv_dim);
        ks.extend_from_slice(k);
        vs.extend_from_slice(v);
    }

    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// (keys, values) of layer `l`, `kv_dim` floats per position.
    pub fn layer(&self, l: usize) -> (&[f32], &[f32]) {
        let (k, v) = &self.layers[l];
        (k, v)
    }

    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.capacity() + v.capacity()) * 4)
            .sum()
    }
}
