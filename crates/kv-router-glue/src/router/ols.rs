//! Ordinary least squares with standard errors, for a handful of columns.
//!
//! `β = (XᵀX)⁻¹ Xᵀy`, residual variance `σ² = RSS / (n − k)`, coefficient
//! covariance `σ² (XᵀX)⁻¹` (textbook OLS, e.g. Greene, *Econometric
//! Analysis*, ch. 4). Sizes here are tiny (k ≤ 3), so the normal equations are
//! solved by Gauss–Jordan elimination with partial pivoting, which also gives
//! the inverse needed for the covariance. Student's t quantiles come from
//! statrs.
//!
//! Private to the crate (calibration is its only user) and total: every
//! shape mismatch is a typed error, never an index panic.

use crate::CalibrationError;

/// A fitted linear model `y ≈ X β`.
#[derive(Debug, Clone, PartialEq)]
pub struct OlsFit {
    /// Coefficients, one per column.
    pub coef: Vec<f64>,
    /// Standard error of each coefficient.
    pub std_err: Vec<f64>,
    /// Coefficient covariance `σ² (XᵀX)⁻¹`, row-major k x k.
    pub cov: Vec<f64>,
    /// Residual degrees of freedom `n − k`.
    pub dof: usize,
    /// Residual standard deviation σ.
    pub sigma: f64,
    /// Coefficient of determination (1 − RSS/TSS; 1 when TSS is 0 and RSS is 0).
    pub r2: f64,
}

impl OlsFit {
    /// Prediction `xᵀβ` and its standard error `sqrt(xᵀ Cov x)` at `x`
    /// (one value per coefficient; missing trailing values count as 0, extra
    /// ones are ignored, so the result is always defined).
    pub fn predict(&self, x: &[f64]) -> (f64, f64) {
        let k = self.coef.len().min(x.len());
        let mean: f64 = x.iter().zip(&self.coef).map(|(a, b)| a * b).sum();
        let mut var = 0.0;
        for i in 0..k {
            for j in 0..k {
                var += x[i] * self.cov[i * self.coef.len() + j] * x[j];
            }
        }
        (mean, var.max(0.0).sqrt())
    }
}

/// Fits `y ≈ X β`; `rows[i]` is row i of X, `names[j]` names column j in errors.
///
/// # Errors
/// [`CalibrationError::Shape`] when `y` and `rows` differ in length or a row
/// does not have one value per name; [`CalibrationError::TooFewSamples`] when
/// `n < k + 2` (an uncertainty estimate needs at least 2 residual degrees of
/// freedom); [`CalibrationError::Singular`] naming the column that is constant
/// or collinear with the earlier ones.
pub(crate) fn fit(
    rows: &[Vec<f64>],
    y: &[f64],
    names: &[&'static str],
) -> Result<OlsFit, CalibrationError> {
    let k = names.len();
    let n = rows.len();
    if y.len() != n {
        return Err(CalibrationError::Shape {
            field: "y",
            index: None,
            got: y.len(),
            want: n,
        });
    }
    if let Some((i, row)) = rows.iter().enumerate().find(|(_, r)| r.len() != k) {
        return Err(CalibrationError::Shape {
            field: "rows",
            index: Some(i),
            got: row.len(),
            want: k,
        });
    }
    if n < k + 2 {
        return Err(CalibrationError::TooFewSamples {
            got: n,
            need: k + 2,
        });
    }
    // XᵀX augmented with the identity: [A | I] -> [I | A⁻¹].
    let mut a = vec![0.0; k * 2 * k];
    let w = 2 * k;
    let mut xty = vec![0.0; k];
    for (row, &yi) in rows.iter().zip(y) {
        for i in 0..k {
            xty[i] += row[i] * yi;
            for j in 0..k {
                a[i * w + j] += row[i] * row[j];
            }
        }
    }
    let diag: Vec<f64> = (0..k).map(|i| a[i * w + i]).collect();
    for i in 0..k {
        a[i * w + k + i] = 1.0;
    }
    for col in 0..k {
        let pivot_row = (col..k)
            .max_by(|&p, &q| a[p * w + col].abs().total_cmp(&a[q * w + col].abs()))
            .unwrap_or(col);
        // A pivot that is tiny relative to the column's own scale means the
        // column is explained by the others: the fit would be arbitrary.
        if a[pivot_row * w + col].abs() <= 1e-9 * diag[col].abs().max(f64::MIN_POSITIVE) {
            return Err(CalibrationError::Singular { column: names[col] });
        }
        if pivot_row != col {
            for j in 0..w {
                a.swap(col * w + j, pivot_row * w + j);
            }
        }
        let p = a[col * w + col];
        for j in 0..w {
            a[col * w + j] /= p;
        }
        for r in 0..k {
            if r != col {
                let f = a[r * w + col];
                if f != 0.0 {
                    for j in 0..w {
                        a[r * w + j] -= f * a[col * w + j];
                    }
                }
            }
        }
    }
    let inv: Vec<f64> = (0..k)
        .flat_map(|i| (0..k).map(move |j| (i, j)))
        .map(|(i, j)| a[i * w + k + j])
        .collect();
    let coef: Vec<f64> = (0..k)
        .map(|i| (0..k).map(|j| inv[i * k + j] * xty[j]).sum())
        .collect();
    let mut rss = 0.0;
    let mean_y = y.iter().sum::<f64>() / n as f64;
    let mut tss = 0.0;
    for (row, &yi) in rows.iter().zip(y) {
        let pred: f64 = row.iter().zip(&coef).map(|(x, b)| x * b).sum();
        rss += (yi - pred).powi(2);
        tss += (yi - mean_y).powi(2);
    }
    let dof = n - k;
    let s2 = rss / dof as f64;
    let cov: Vec<f64> = inv.iter().map(|v| v * s2).collect();
    let std_err = (0..k).map(|i| cov[i * k + i].max(0.0).sqrt()).collect();
    let r2 = if tss > 0.0 {
        1.0 - rss / tss
    } else if rss == 0.0 {
        1.0
    } else {
        0.0
    };
    Ok(OlsFit {
        coef,
        std_err,
        cov,
        dof,
        sigma: s2.sqrt(),
        r2,
    })
}

/// One-sided 95% quantile of Student's t with `dof` degrees of freedom
/// (statrs' inverse CDF at 0.95); infinite for 0 degrees of freedom, where
/// no uncertainty estimate exists.
pub(crate) fn t_one_sided_95(dof: usize) -> f64 {
    statrs::distribution::StudentsT::new(0.0, 1.0, dof as f64).map_or(f64::INFINITY, |t| {
        statrs::distribution::ContinuousCDF::inverse_cdf(&t, 0.95)
    })
}
