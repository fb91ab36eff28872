//! Fewer KV heads: every `r = kv_heads / N` consecutive KV heads of a layer become one
//! (their query heads keep attending together, now to the merged head), by [`Method::Mean`]
//! or [`Method::Svd`] (Yu et al., arXiv 2406.07056 §3; see the crate docs).
//!
//! SVD, per layer and merged group, in HF's layout (RoPE rotates channels `i` and `i + d/2`
//! of a head together), with `S` the layer's input moments ([`crate::calibrate`]):
//!
//! * values: `U` = the top `d` eigenvectors of the group's value covariance `V S Vᵀ`
//!   (`r·d × r·d`); the merged head projects `Uᵀ V`, and head `h`'s values are read back as
//!   `U_h z`, which folds into the output projection: `W_o,j ← W_o,j U_h` for every query
//!   head `j` of `h`.
//! * keys: at frequency `i` each head's key pair is a complex number `κ_h`, and RoPE
//!   multiplies it by `e^{iθ·pos}`. `a` = the top eigenvector of the group's `r × r`
//!   Hermitian covariance `E[κ κᴴ]`; the merged head stores `z = aᴴ κ`, head `h` is read
//!   back as `a_h z`, and `q · k_h ≈ Re(q̄ a_h z)` folds `conj(a_h)` into the query pair of
//!   every query head of `h`. Scalars per frequency commute with RoPE, so the fold holds at
//!   every position.
use nalgebra::DMatrix;
use serde_json::json;

use crate::calibrate::Moments;
use crate::checkpoint::{AttnShape, Checkpoint};
use crate::error::{CompressError, Result};
use crate::linalg::{
    covariance, to_matrix, to_tensor, top_eigenvector_hermitian, top_eigenvectors,
};
use crate::Method;

/// One projection of a layer as `[W b]` (`out × (in + 1)`; the last column is 0 without a
/// bias), with the names and dtype to write it back under.
struct Projection {
    m: DMatrix<f64>,
    weight: String,
    bias: Option<String>,
    dtype: candle_core::DType,
}

impl Projection {
    fn read(ck: &Checkpoint, prefix: &str) -> Result<Self> {
        let weight = format!("{prefix}.weight");
        let w = ck.tensor(&weight)?;
        let dtype = w.dtype();
        let wm = to_matrix(w)?;
        let bias_name = format!("{prefix}.bias");
        let (rows, cols) = wm.shape();
        let mut m = DMatrix::zeros(rows, cols + 1);
        m.view_mut((0, 0), (rows, cols)).copy_from(&wm);
        let bias = match ck.tensors.get(&bias_name) {
            Some(b) => {
                m.column_mut(cols).copy_from(&to_matrix(b)?.column(0));
                Some(bias_name)
            }
            None => None,
        };
        Ok(Self {
            m,
            weight,
            bias,
            dtype,
        })
    }

    fn write(&self, ck: &mut Checkpoint) -> Result<()> {
        let (rows, cols) = self.m.shape();
        let w = self.m.view((0, 0), (rows, cols - 1)).into_owned();
        ck.tensors.insert(
            self.weight.clone(),
            to_tensor(&w, &[rows, cols - 1], self.dtype)?,
        );
        if let Some(b) = &self.bias {
            let col = self.m.column(cols - 1).into_owned();
            let col = DMatrix::from_column_slice(rows, 1, col.as_slice());
            ck.tensors
                .insert(b.clone(), to_tensor(&col, &[rows], self.dtype)?);
        }
        Ok(())
    }

    /// Rows `[h·d, (h+1)·d)` for each head `h` in `heads`, stacked.
    fn heads(&self, heads: std::ops::Range<usize>, d: usize) -> DMatrix<f64> {
        self.m.rows(heads.start * d, heads.len() * d).into_owned()
    }
}

/// Checks `to` against the model's KV heads before any work.
pub fn check_target(shape: &AttnShape, to: usize) -> Result<()> {
    if to == 0 || !shape.kv_heads.is_multiple_of(to) {
        return Err(CompressError::Setting(format!(
            "--kv-heads {to} does not divide the model's {} KV heads; give one of {}",
            shape.kv_heads,
            (1..=shape.kv_heads)
                .filter(|n| shape.kv_heads.is_multiple_of(*n))
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

/// Merges `ck`'s KV heads down to `to` per layer with `method` (`moments` required for
/// SVD). `to` equal to today's count leaves every tensor as it is.
pub fn compress_heads(
    ck: &mut Checkpoint,
    to: usize,
    method: Method,
    moments: Option<&Moments>,
) -> Result<()> {
    let shape = ck.shape()?;
    check_target(&shape, to)?;
    if to == shape.kv_heads {
        return Ok(());
    }
    for layer in 0..shape.layers {
        let s = match (method, moments) {
            (Method::Mean, _) => None,
            (Method::Svd, Some(m)) => {
                let data = m.layers.get(layer).ok_or_else(|| {
                    CompressError::Checkpoint(format!("calibration saw no layer {layer}"))
                })?;
                Some(DMatrix::from_row_slice(m.dim, m.dim, data))
            }
            (Method::Svd, None) => {
                return Err(CompressError::Setting(
                    "the svd method needs calibration moments".into(),
                ))
            }
        };
        compress_layer(ck, &shape, layer, to, s.as_ref())?;
    }
    ck.config.insert("num_key_value_heads".into(), json!(to));
    Ok(())
}

fn compress_layer(
    ck: &mut Checkpoint,
    shape: &AttnShape,
    layer: usize,
    to: usize,
    s: Option<&DMatrix<f64>>,
) -> Result<()> {
    let p = format!("model.layers.{layer}.self_attn");
    let mut q = Projection::read(ck, &format!("{p}.q_proj"))?;
    let mut k = Projection::read(ck, &format!("{p}.k_proj"))?;
    let mut v = Projection::read(ck, &format!("{p}.v_proj"))?;
    let mut o = Projection::read(ck, &format!("{p}.o_proj"))?;
    let d = shape.head_dim;
    let (qd, kvd, h) = (shape.heads * d, shape.kv_heads * d, shape.hidden);
    for (proj, want) in [
        (&q, (qd, h + 1)),
        (&k, (kvd, h + 1)),
        (&v, (kvd, h + 1)),
        (&o, (h, qd + 1)),
    ] {
        if proj.m.shape() != want {
            return Err(CompressError::Checkpoint(format!(
                "{} is {}×{} but config.json's shape makes it {}×{}; check that config.json belongs to these weights",
                proj.weight,
                proj.m.nrows(),
                proj.m.ncols() - 1,
                want.0,
                want.1 - 1
            )));
        }
    }
    let r = shape.kv_heads / to;
    let g = shape.heads / shape.kv_heads;
    let cols = k.m.ncols();
    let mut k_new = DMatrix::zeros(to * d, cols);
    let mut v_new = DMatrix::zeros(to * d, cols);
    for c in 0..to {
        let heads = c * r..(c + 1) * r;
        let kg = k.heads(heads.clone(), d);
        let vg = v.heads(heads.clone(), d);
        let Some(s) = s else {
            // Mean pooling.
            for l in 0..r {
                let blk = |m: &DMatrix<f64>| m.rows(l * d, d).into_owned() / r as f64;
                let mut kv = k_new.rows_mut(c * d, d);
                kv += blk(&kg);
                let mut vv = v_new.rows_mut(c * d, d);
                vv += blk(&vg);
            }
            continue;
        };
        // Values: principal subspace, read back through the output projection.
        let u = top_eigenvectors(&covariance(&vg, s), d);
        v_new.rows_mut(c * d, d).copy_from(&(u.transpose() * &vg));
        // Keys: a complex direction per frequency, read back through the queries.
        let ck_cov = covariance(&kg, s);
        let mut kz = DMatrix::zeros(d, cols);
        // Per frequency, the group's complex direction (one entry per merged head).
        let mut phase = Vec::with_capacity(d / 2);
        for i in 0..d / 2 {
            let re = |h: usize| h * d + i;
            let im = |h: usize| h * d + i + d / 2;
            let cm = DMatrix::from_fn(r, r, |a, b| {
                nalgebra::Complex::new(
                    ck_cov[(re(a), re(b))] + ck_cov[(im(a), im(b))],
                    ck_cov[(im(a), re(b))] - ck_cov[(re(a), im(b))],
                )
            });
            let a = top_eigenvector_hermitian(&cm);
            for h in 0..r {
                let (al, be) = (a[h].re, a[h].im);
                let (kr, ki) = (kg.row(re(h)).into_owned(), kg.row(im(h)).into_owned());
                let mut row = kz.row_mut(i);
                row += &kr * al + &ki * be;
                let mut row = kz.row_mut(i + d / 2);
                row += &ki * al - &kr * be;
            }
            phase.push(a);
        }
        k_new.rows_mut(c * d, d).copy_from(&kz);
        for h in heads {
            let l = h - c * r;
            let uh = u.rows(l * d, d).into_owned();
            for j in h * g..(h + 1) * g {
                let block = o.m.columns(j * d, d) * &uh;
                o.m.columns_mut(j * d, d).copy_from(&block);
                for (i, a) in phase.iter().map(|a| a[l]).enumerate() {
                    let (qr, qi) = (
                        q.m.row(j * d + i).into_owned(),
                        q.m.row(j * d + i + d / 2).into_owned(),
                    );
                    q.m.row_mut(j * d + i).copy_from(&(&qr * a.re + &qi * a.im));
                    q.m.row_mut(j * d + i + d / 2)
                        .copy_from(&(&qi * a.re - &qr * a.im));
                }
            }
        }
    }
    k.m = k_new;
    v.m = v_new;
    for proj in [&q, &k, &v, &o] {
        proj.write(ck)?;
    }
    Ok(())
}
