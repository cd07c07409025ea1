//! A throw-away PKI for one test cluster: one CA signs the apiserver's and the extender's serving
//! certificates and kube-scheduler's client certificate, so every hop is real, verified TLS.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

/// A PEM certificate and its PEM private key.
#[derive(Debug, Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

pub struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

impl Pki {
    pub fn new() -> Result<Self, rcgen::Error> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "tessera-e2e-ca");
        Ok(Pki {
            ca: CertifiedIssuer::self_signed(params, KeyPair::generate()?)?,
        })
    }

    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A serving certificate for `sans` (IP addresses become IP SANs).
    pub fn server(&self, common_name: &str, sans: &[&str]) -> Result<Pem, rcgen::Error> {
        self.leaf(common_name, sans, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate whose common name is the user name.
    pub fn client(&self, user: &str) -> Result<Pem, rcgen::Error> {
        self.client_in(user, &[])
    }

    /// A client certificate for `user` in `groups` (the API server reads the organizations as
    /// groups: `system:nodes` for a kubelet, `system:masters` for an administrator).
    pub fn client_in(&self, user: &str, groups: &[&str]) -> Result<Pem, rcgen::Error> {
        self.leaf_with(user, groups, &[], ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(
        &self,
        common_name: &str,
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<Pem, rcgen::Error> {
        self.leaf_with(common_name, &[], sans, usage)
    }

    fn leaf_with(
        &self,
        common_name: &str,
        organizations: &[&str],
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<Pem, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        for o in organizations {
            params.distinguished_name.push(DnType::OrganizationName, *o);
        }
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.ca)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

/// A key for signing service-account tokens (ES256): the PKCS#8 private key and the public key,
/// both PEM (the apiserver reads public keys only from `--service-account-key-file`).
pub fn service_account_key() -> Result<Pem, rcgen::Error> {
    let key = KeyPair::generate()?;
    Ok(Pem {
        cert: key.public_key_pem(),
        key: key.serialize_pem(),
    })
}
