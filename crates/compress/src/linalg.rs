//! The dense linear algebra the SVD method needs, on `nalgebra` in f64: tensors to and from
//! matrices, covariances `W S Wᵀ`, and the leading eigenvectors of real symmetric and
//! complex Hermitian matrices.
use candle_core::{DType, Device, Tensor};
use nalgebra::{Complex, DMatrix, DVector, SymmetricEigen};

use crate::error::Result;

/// A 1-D or 2-D tensor as an f64 matrix (a vector becomes one column).
pub fn to_matrix(t: &Tensor) -> Result<DMatrix<f64>> {
    let data = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok(match t.dims() {
        [r, c] => DMatrix::from_row_slice(*r, *c, &data),
        _ => DMatrix::from_column_slice(data.len(), 1, &data),
    })
}

/// A matrix back as a tensor of `dtype` with `dims` (the matrix's row-major elements).
pub fn to_tensor(m: &DMatrix<f64>, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let row_major: Vec<f64> = m.transpose().as_slice().to_vec();
    Ok(Tensor::from_vec(row_major, dims, &Device::Cpu)?.to_dtype(dtype)?)
}

/// `w s wᵀ`.
pub fn covariance(w: &DMatrix<f64>, s: &DMatrix<f64>) -> DMatrix<f64> {
    w * s * w.transpose()
}

/// The eigenvectors of the `k` largest eigenvalues of symmetric `m`, as columns, largest
/// first.
pub fn top_eigenvectors(m: &DMatrix<f64>, k: usize) -> DMatrix<f64> {
    let eig = SymmetricEigen::new(m.clone());
    let mut order: Vec<usize> = (0..eig.eigenvalues.len()).collect();
    order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
    let cols: Vec<DVector<f64>> = order
        .iter()
        .take(k)
        .map(|&i| eig.eigenvectors.column(i).into_owned())
        .collect();
    DMatrix::from_columns(&cols)
}

/// The unit eigenvector of the largest eigenvalue of Hermitian `c`.
pub fn top_eigenvector_hermitian(c: &DMatrix<Complex<f64>>) -> DVector<Complex<f64>> {
    let eig = SymmetricEigen::new(c.clone());
    let best = (0..eig.eigenvalues.len())
        .max_by(|&a, &b| eig.eigenvalues[a].total_cmp(&eig.eigenvalues[b]))
        .unwrap_or(0);
    eig.eigenvectors.column(best).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_eigenvectors_span_a_rank_one_covariance() {
        let v = DVector::from_vec(vec![1.0, 2.0, -2.0]) / 3.0;
        let m = &v * v.transpose() * 5.0;
        let u = top_eigenvectors(&m, 1);
        assert!((u.column(0).dot(&v).abs() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn hermitian_top_eigenvector_finds_a_complex_direction() {
        let a = DVector::from_vec(vec![Complex::new(0.6, 0.0), Complex::new(0.0, 0.8)]);
        let c = &a * a.adjoint();
        let got = top_eigenvector_hermitian(&c);
        let overlap = got.adjoint() * &a;
        assert!((overlap[(0, 0)].norm() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn matrices_round_trip_through_tensors() -> Result<()> {
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((2, 3))?;
        let m = to_matrix(&t)?;
        assert_eq!(m[(1, 0)], 3.0);
        let back = to_tensor(&m, &[2, 3], DType::F32)?;
        assert_eq!(back.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        Ok(())
    }
}
