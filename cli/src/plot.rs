//! The loss-curve picture written after training (PNG, via plotters).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use wgrad::{Error, Result};

static FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSansMono.ttf");

fn plot_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument {
        op: "plot_loss_curve",
        reason: format!("{}: {e}", path.display()),
    }
}

/// Draws `points` (step, loss) as a line on a log-scaled loss axis, with
/// `title` above it, into a PNG at `path`.
pub fn loss_curve(path: impl AsRef<Path>, title: &str, points: &[(u64, f32)]) -> Result<()> {
    loss_curves(path, title, &[("train", points)])
}

/// [`loss_curve`] with several named curves (train and validation) on one
/// axis, with a legend.
pub fn loss_curves(path: impl AsRef<Path>, title: &str, curves: &[(&str, &[(u64, f32)])]) -> Result<()> {
    let path = path.as_ref();
    let points: Vec<(u64, f32)> = curves.iter().flat_map(|c| c.1.iter().copied()).collect();
    if points.is_empty() {
        return Err(plot_error(path, "no loss values to plot"));
    }
    // The font is embedded so the picture has labels on bare machines.
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| plot_error(path, e))?;
    }
    let max_step = points.iter().map(|p| p.0).max().unwrap_or(1).max(1);
    let finite: Vec<f32> = points
        .iter()
        .map(|p| p.1)
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let lo = finite.iter().copied().fold(f32::INFINITY, f32::min).max(1e-6);
    let hi = finite.iter().copied().fold(0.0f32, f32::max).max(lo * 1.01);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(path, e))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60);
    // A log axis shows a loss falling by decades (an MLP to 1e-3); over
    // less than a decade (a language model's 4.4 → 2.2) it would have no
    // labelled tick, so the axis is linear there.
    if hi / lo > 10.0 {
        let mut chart = builder
            .build_cartesian_2d(0u64..max_step, (lo * 0.9..hi * 1.1).log_scale())
            .map_err(|e| plot_error(path, e))?;
        draw_curves(path, &mut chart, curves)?;
    } else {
        let mut chart = builder
            .build_cartesian_2d(0u64..max_step, lo * 0.95..hi * 1.05)
            .map_err(|e| plot_error(path, e))?;
        draw_curves(path, &mut chart, curves)?;
    }
    root.present().map_err(|e| plot_error(path, e))?;
    Ok(())
}

fn draw_curves<'a, Y>(
    path: &Path,
    chart: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<plotters::coord::types::RangedCoordu64, Y>>,
    curves: &[(&str, &[(u64, f32)])],
) -> Result<()>
where
    Y: Ranged<ValueType = f32> + plotters::coord::ranged1d::ValueFormatter<f32>,
{
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()
        .map_err(|e| plot_error(path, e))?;
    let colors = [BLUE, RED, GREEN, MAGENTA];
    for (i, (name, series)) in curves.iter().enumerate() {
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                series
                    .iter()
                    .filter(|p| p.1.is_finite() && p.1 > 0.0)
                    .map(|&(s, l)| (s, l)),
                color.stroke_width(2),
            ))
            .map_err(|e| plot_error(path, e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    if curves.len() > 1 {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot_error(path, e))?;
    }
    Ok(())
}
