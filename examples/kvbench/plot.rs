//! SVG charts of a sweep (plotters): decode tok/s, peak device KV bytes (log scale) and
//! host→device bytes per token, each against the context length, one line per policy; and
//! for a sweep of `auto:BUDGET` variants, decode s/token against the budget.
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;

use crate::sweep::Row;
use kvpolicy_cli::atomic::write_atomic;

/// One chart: which value, its axis title, the file name, whether the y axis is logarithmic.
struct Chart {
    value: fn(&Row) -> f64,
    title: &'static str,
    file: &'static str,
    log_y: bool,
}

const CHARTS: [Chart; 3] = [
    Chart {
        value: |r| r.decode_tok_s,
        title: "decode tokens/s",
        file: "decode_tok_s.svg",
        log_y: false,
    },
    Chart {
        value: |r| r.device_kv_peak_bytes as f64,
        title: "peak device-tier KV bytes",
        file: "device_kv_bytes.svg",
        log_y: true,
    },
    Chart {
        value: |r| r.h2d_bytes_per_token as f64,
        title: "host→device bytes per decoded token",
        file: "h2d_bytes_per_token.svg",
        log_y: false,
    },
];

/// Writes the three charts into `dir`; returns their paths.
pub fn draw(rows: &[Row], dir: &Path, model: &str) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut policies: Vec<&str> = Vec::new();
    for r in rows {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    let mut written = Vec::new();
    for chart in &CHARTS {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (720, 440)).into_drawing_area();
            draw_one(&root, rows, &policies, chart, model)?;
            root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let path = dir.join(chart.file);
        write_atomic(&path, |w| Ok(w.write_all(svg.as_bytes())?))?;
        written.push(path);
    }
    Ok(written)
}

fn draw_one(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    rows: &[Row],
    policies: &[&str],
    chart: &Chart,
    model: &str,
) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing {}: {e}", chart.file);
    root.fill(&WHITE).map_err(err)?;
    let points: Vec<(&str, f64, f64)> = rows
        .iter()
        .filter(|r| !(chart.log_y && (chart.value)(r) <= 0.0))
        .filter(|r| !(r.policy == "stock" && chart.file != "decode_tok_s.svg"))
        .map(|r| (r.policy.as_str(), r.context as f64, (chart.value)(r)))
        .collect();
    let (xmin, xmax) = points
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let ymax = points.iter().fold(0f64, |m, p| m.max(p.2)).max(1.0);
    let ymin = points.iter().fold(f64::MAX, |m, p| m.min(p.2)).max(1.0);
    let (xmin, xmax) = if xmin < xmax {
        (xmin, xmax)
    } else {
        (xmin.max(2.0) / 2.0, xmax.max(1.0) * 2.0)
    };
    let caption = format!("{} — {model}", chart.title);
    let mut b = ChartBuilder::on(root);
    b.caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80);
    let colors = [&BLUE, &RED, &GREEN, &MAGENTA, &CYAN, &BLACK];
    macro_rules! series {
        ($c:expr) => {{
            let mut c = $c;
            c.configure_mesh()
                .x_desc("context (tokens)")
                .y_desc(chart.title)
                .draw()
                .map_err(err)?;
            for (i, p) in policies.iter().enumerate() {
                let color = colors[i % colors.len()];
                let line: Vec<(f64, f64)> = points
                    .iter()
                    .filter(|q| q.0 == *p)
                    .map(|q| (q.1, q.2))
                    .collect();
                if line.is_empty() {
                    continue;
                }
                c.draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(*p)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
                c.draw_series(line.iter().map(|&pt| Circle::new(pt, 3, color.filled())))
                    .map_err(err)?;
            }
            c.configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(err)?;
        }};
    }
    let x = (xmin * 0.9..xmax * 1.1).log_scale();
    if chart.log_y {
        series!(b
            .build_cartesian_2d(x, (ymin * 0.5..ymax * 2.0).log_scale())
            .map_err(err)?);
    } else {
        series!(b.build_cartesian_2d(x, 0.0..ymax * 1.15).map_err(err)?);
    }
    Ok(())
}

/// With two or more `auto:BUDGET` rows at the largest context: decode seconds per token
/// against the budget (`auto_budget.svg`), with `full` and every `headwise` row at that
/// context as horizontal references — the curve should fall from the streaming policies'
/// time to `full`'s as the budget grows. `None` when the sweep has no such rows.
pub fn draw_budget_sweep(rows: &[Row], dir: &Path, model: &str) -> Result<Option<PathBuf>> {
    let Some(context) = rows.iter().map(|r| r.context).max() else {
        return Ok(None);
    };
    let at: Vec<&Row> = rows.iter().filter(|r| r.context == context).collect();
    let mut curve: Vec<(f64, f64)> = at
        .iter()
        .filter_map(|r| {
            let spec = kvpolicy::PolicySpec::parse(&r.policy).ok()?;
            let value = match spec.settings.as_slice() {
                [one]
                    if spec.name == "auto" && one.key.as_deref().is_none_or(|k| k == "budget") =>
                {
                    &one.value
                }
                _ => return None,
            };
            let budget = kvpolicy::parse_bytes(value).ok()?;
            Some((budget as f64 / (1 << 20) as f64, 1.0 / r.decode_tok_s))
        })
        .collect();
    if curve.len() < 2 {
        return Ok(None);
    }
    curve.sort_by(|a, b| a.0.total_cmp(&b.0));
    let refs: Vec<(&str, f64)> = at
        .iter()
        .filter(|r| r.policy == "full" || r.policy.starts_with("headwise"))
        .map(|r| (r.policy.as_str(), 1.0 / r.decode_tok_s))
        .collect();
    let (x0, x1) = (curve[0].0, curve[curve.len() - 1].0);
    let ymax = curve
        .iter()
        .map(|p| p.1)
        .chain(refs.iter().map(|r| r.1))
        .fold(0f64, f64::max);
    let file = dir.join("auto_budget.svg");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 440)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing auto_budget.svg: {e}");
        root.fill(&WHITE).map_err(err)?;
        let mut c = ChartBuilder::on(&root)
            .caption(
                format!("auto: decode s/token vs device KV budget at {context} tokens — {model}"),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(x0 * 0.9..x1 * 1.05, 0.0..ymax * 1.15)
            .map_err(err)?;
        c.configure_mesh()
            .x_desc("--device-kv-budget (MiB)")
            .y_desc("decode seconds per token")
            .draw()
            .map_err(err)?;
        c.draw_series(LineSeries::new(curve.clone(), BLUE.stroke_width(2)))
            .map_err(err)?
            .label("auto")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
        c.draw_series(curve.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))
            .map_err(err)?;
        let colors = [&RED, &GREEN, &MAGENTA, &BLACK];
        for (i, (name, y)) in refs.iter().enumerate() {
            let color = colors[i % colors.len()];
            c.draw_series(LineSeries::new(
                vec![(x0 * 0.9, *y), (x1 * 1.05, *y)],
                color.stroke_width(1),
            ))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(1))
            });
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    write_atomic(&file, |w| Ok(w.write_all(svg.as_bytes())?))?;
    Ok(Some(file))
}
